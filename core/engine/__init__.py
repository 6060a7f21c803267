"""Engine: engine core, executor protocol, engine args, clients (in-process and over ZMQ), the engine process,
its messages, the front ends (LLM, AsyncLLM) with their input/output processing and detokenizer."""
