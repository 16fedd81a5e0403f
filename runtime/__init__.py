"""What every worker process does besides running its engine (membership, heartbeats, routes
back to gateways): shared by the prefill, decode and colocated workers, outside the engine."""
