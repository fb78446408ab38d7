"""What runs inside a training script's process: the worker-side API. It imports only the kernel, never the
master, the agent or the RPC server (import-linter checks it), so a script pays for nothing else."""
