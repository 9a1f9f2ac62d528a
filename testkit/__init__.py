"""The test and benchmark kit, kept in the checkout and never installed: a fake vLLM server, a
process harness around it, test documents and a runner for `ocrvl` itself."""
