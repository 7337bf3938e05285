"""The OpenAI routes for completions and chat: request bodies, parameters, templates, structured output, and the answers in OpenAI's shapes."""
