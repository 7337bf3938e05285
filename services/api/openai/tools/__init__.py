"""Tool calling: what tools and tool_choice ask, how the model is shown its tools, and its calls parsed from its text."""
