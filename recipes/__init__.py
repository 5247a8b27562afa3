"""Recipes: the main job (`train_lm`), its models (`gpt`) and data (`data`), benchmarks."""
