# One image for both containers of a meshd "pod": `meshd serve` and the reference runtime.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY meshd ./meshd
RUN pip install --no-cache-dir -c constraints.txt ".[otel]"
EXPOSE 8033 8080 8085 8008 2112
ENTRYPOINT ["meshd"]
CMD ["serve"]
