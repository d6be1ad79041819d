"""Post-training on preference pairs: DPO and reward-model losses, per-sequence values of preference rows."""
