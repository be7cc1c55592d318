# One image for every gpumeter service: `gpumeter <service>` picks the role.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY gpumeter ./gpumeter
COPY services ./services
COPY schemas ./schemas
COPY scenarios ./scenarios
RUN pip install --no-cache-dir -c constraints.txt . \
    && useradd --system --uid 10001 gpumeter
USER 10001
ENTRYPOINT ["gpumeter"]
