"""`servetwin validate`: predict published vLLM runs; fitting hardware presets to them."""
