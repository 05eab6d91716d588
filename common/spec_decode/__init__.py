"""Speculative decoding: proposers guess draft tokens cheaply, the target model verifies them all
in one forward pass, and rejection sampling keeps exactly the tokens plain decoding could give."""
