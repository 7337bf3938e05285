"""OpenAI's Files and Batch APIs: files and batches in JetStream, and the runner that answers their lines."""
