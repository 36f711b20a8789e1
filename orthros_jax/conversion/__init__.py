"""Dense -> Orthros conversion (docs/ARCHITECTURE.md section 5): attention
transfer of the feature maps and window weights, then LoRA finetuning."""
