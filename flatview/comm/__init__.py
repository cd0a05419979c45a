"""Communication: masked gradient reduction, skip-set agreement, and byte accounting."""
