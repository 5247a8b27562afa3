"""The main job's pieces: models (`gpt`, `llama`), data, flags and resume (`harness`), metrics (`run_log`)."""
