"""What runs in Ray Serve's HTTP proxy, before a request reaches an Ingress replica: the admission
gate (`gate`, an ASGI middleware Serve installs from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`),
the prefix-affinity request router (`router`, over the pure `prefix`), and request migration
(`migration`: the gate's log of a stream and the header with which the Ingress resumes it).
Nothing is imported here: the proxy loads only what it names."""
