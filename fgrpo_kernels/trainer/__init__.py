"""A thin GRPO-family trainer for Hugging Face causal LMs."""
