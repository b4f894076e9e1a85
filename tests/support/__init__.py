"""Shared test harnesses: real servers started on loopback (Redis, Prometheus), the pod network of
network namespaces, fake workers and the HF oracle. Test files live beside the code they test."""
