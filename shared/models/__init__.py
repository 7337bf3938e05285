"""Model files and tokenizers: where artifacts live, GGUF metadata, Hub ids, architectures, the
tokenizer and detokenizer, and custom models' artifacts and environments."""
