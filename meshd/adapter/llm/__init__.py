"""`meshd llm-runtime`: OpenAI-compatible LLM engines (llama.cpp's server, vLLM, SGLang)
behind the ModelRuntime SPI, one supervised engine process per loaded model.

`engines` decides (pure: command lines, restart backoff), `process` runs one engine,
`runtime` is the SPI servicer and the table of engines, `calls` serves inference
(meshd.llm.OpenAI/Call and KServe text completions, mapped by `textmap`), `main` the command.
"""
