"""What every run of vLLM shares, in-process or in a subprocess: its environment and process handling.

The simulator, the engine runner and the tensor-parallel launcher all build on this layer; none of them
may import another for it.
"""
