"""What every simulated scheduler shares: requests, steps, pools' footprints, the step-time model."""
