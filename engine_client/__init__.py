"""Remote forms of the Engine API: the HTTP client, the Ray engine actor and its client."""
