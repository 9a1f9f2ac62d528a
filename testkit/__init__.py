"""Test and benchmark helpers: a fake vLLM server and a process harness around it."""
