"""The main job's pieces: models (`gpt`, `llama`), data, set-up and reports (`harness`),
checkpoints, metrics (`run_log`)."""
