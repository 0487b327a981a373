"""What every app of the control plane shares: errors, request ids, Redis access, API plumbing."""
