"""Text: tokenizer and chat templates, incremental detokenizer and stop strings, the OpenAI protocol models (no torch)."""
