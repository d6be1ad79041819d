"""Exchange with other ecosystems: Hugging Face Llama checkpoints and reward models through one
declarative table (`hf`), and LoRA adapters in PEFT's format (`hf_peft`).
"""
