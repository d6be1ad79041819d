"""Exchange with other ecosystems: Hugging Face Llama checkpoints and reward models through one
declarative table (`hf`), LoRA adapters in PEFT's format (`hf_peft`), and a run's tokenizer as a Hugging Face
tokenizer directory that gives the run's own ids (`tokenizer_export`).
"""
