"""The HTTP layer: the OpenAI-style routes (completions, chat, Responses, tokenize), request parsing,
tenants, grammar constraints and tool calls. Talks to the engine through its requests."""
