"""Clients of the streaming token server: gRPC client, websocket bridge, chat page, benchmark."""
