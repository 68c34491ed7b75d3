"""A free localhost port for a gloo process group started by a worker script."""
import socket


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
