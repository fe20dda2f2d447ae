"""Getting a model into memory: where its files come from (local, GGUF, builtin wheels, the checked hub
fetcher) and loading chat models (mlx-lm), VLMs (mlx-vlm) and encoders (mlx-embeddings)."""
