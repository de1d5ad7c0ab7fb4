"""The ports a local Ray head is given (moe_operator.standalone.local_ray.free_port)."""

from __future__ import annotations


def test_free_ports_are_outside_the_ephemeral_and_ray_worker_ranges_and_bindable():
    """A port from the kernel's ephemeral range could be taken as an outgoing connection's source
    port before Ray binds it (a runtime-env agent failed so, and its head with it)."""
    import socket

    from moe_operator.standalone.local_ray import ephemeral_ports, free_port

    ephemeral = ephemeral_ports()
    assert len(ephemeral) > 1000 and ephemeral.start >= 1024
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never handed out twice
    for port in ports:
        assert port not in ephemeral and port not in range(10002, 30000), port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
