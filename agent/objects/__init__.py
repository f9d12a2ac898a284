"""The Kubernetes API's objects as JSON, read (`read`) and written (`write`): pure, beneath the node side and
the arbiter alike."""
