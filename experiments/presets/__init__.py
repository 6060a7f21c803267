"""`servetwin presets`: list the model and hardware presets."""
