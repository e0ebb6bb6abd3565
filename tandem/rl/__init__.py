"""The GRPO driver behind `tandem train`: joins rollout/ and trainer_bridge/."""
