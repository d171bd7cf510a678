"""The conformance harness for the sm90 flash-attention kernel."""
