"""The OpenAI surface of the Ingress. Pure (no Ray, no HTTP server, no engine run): what a request
says (`protocol`: the body decoded and validated), the prompt a chat makes (`chat`), the text a
choice's tokens make (`text`: stop sequences; `reasoning`: thinking apart from the answer;
`tools`: tool calls), what may come next (`structured`: response_format as a grammar), the
answers as typed models (`responses`) and spelt in OpenAI's terms (`render`). Over the engine it
is handed: `serving.OpenAIServing`, the request path from body to answer, whole or streamed, which
the Ingress' routes delegate to. Nothing is imported here: the proxy's gate takes `protocol` alone."""
