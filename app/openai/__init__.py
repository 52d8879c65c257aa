"""OpenAI-compatible HTTP surface: request schemas, response framing, the ingress deployment."""
