"""Remote models: models other servers serve, their replicas, how a request is
balanced among them, forwarded, and its answer relayed back."""
