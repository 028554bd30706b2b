"""Harnesses the test folders share: tiny models, exports and servers built once."""
