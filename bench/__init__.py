"""Serving benchmark for any OpenAI-compatible server (Switchyard, llama.cpp's server, vLLM...)."""
