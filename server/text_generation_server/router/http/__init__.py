"""The HTTP APIs clients already speak, OpenAI's and TGI's, served beside the gRPC API (`serve --http-port`)."""
