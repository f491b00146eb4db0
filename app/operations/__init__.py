"""What stands in front of the API: admission, keys, drain, metrics, accounting, audit, transport."""
