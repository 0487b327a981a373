"""Read side of the fleet's telemetry: merge the workers' snapshot streams for dashboards and /metrics."""
