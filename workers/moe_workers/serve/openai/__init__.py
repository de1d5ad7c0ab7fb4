"""The OpenAI surface of the Ingress, pure (no Ray, no HTTP server, no engine run here): what a
request says (`protocol`: the body decoded and validated), the prompt a chat makes (`chat`), the
text a choice's tokens make (`text`: stop sequences; `reasoning`: thinking apart from the answer;
`tools`: tool calls), what may come next (`structured`: response_format as a grammar), and the
answer spelt in OpenAI's terms (`render`). Nothing is imported here: the proxy's gate takes
`protocol` alone."""
