"""The experiment YAML parsed once into typed objects: the schema, the workload generators, the SLOs."""
