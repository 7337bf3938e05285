"""LoRA adapters over a served base model: PEFT's files, the layers that add them per row, their slots."""
