"""Usage metering, pricing and exports."""
