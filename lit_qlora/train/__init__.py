"""What runs around a training step: checkpoints, metrics, resume and locks (`training`), the preference
objective, experiment trackers, and lm-eval evaluation."""
