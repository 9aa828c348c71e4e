"""Speculative decoding: draft proposers (n-gram prompt lookup) whose drafts the target verifies."""
