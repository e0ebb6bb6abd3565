"""Multi-LoRA serving: PEFT adapters (adapter.py), the core's registry of loaded ones (registry.py),
and the per-forward view the model's target linears read (lora_batch.py)."""
