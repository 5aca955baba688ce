"""Sources of desired state: a directory of YAML manifests, or a Kubernetes API watch."""
