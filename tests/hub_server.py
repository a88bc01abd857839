"""A minimal Hugging Face Hub for tests, served on 127.0.0.1 only (no network, nothing mocked in-process).

It implements exactly the HTTP endpoints that ``HfApi.create_repo``, ``HfApi.upload_folder`` and
``hf_hub_download`` / ``from_pretrained`` call, so ``push_to_hub`` can be tested end to end by
pointing ``HF_ENDPOINT`` at it:

- ``POST /api/repos/create``                        create a model repo (409 if it exists)
- ``POST /api/validate-yaml``                       check the README front matter parses to a mapping
- ``POST /api/models/{repo}/preupload/{revision}``  every file is a "regular" upload (no LFS / Xet)
- ``POST /api/models/{repo}/commit/{revision}``     NDJSON commit: header, base64 files, deletions
- ``POST /api/models/{repo}/branch/{branch}``       create a branch (409 if it exists)
- ``GET  /api/models/{repo}[/revision/{revision}]`` model_info (sha, siblings)
- ``GET  /api/models/{repo}/tree/{revision}[/{path}]`` list files
- ``HEAD/GET /{repo}/resolve/{revision}/{path}``    file download with X-Repo-Commit, ETag, Content-Length

Repos live in memory. Writes need ``Authorization: Bearer <token>``; request bodies and total
storage are capped; idle connections time out, so the server always shuts down promptly.
Requests it does not implement answer 404 and are recorded in ``HubServer.unhandled``, so a test can
assert that the client used nothing this server only pretends to support.

Usage::

    with HubServer(token="hf_test") as hub:
        env = {"HF_ENDPOINT": hub.endpoint, ...}   # then run the client in a subprocess
        hub.file("me/tiny-rat", "README.md")       # bytes at the head of main
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

DEFAULT_BRANCH = "main"


def git_blob_sha(content: bytes) -> str:
    """The git object id of a file: what the Hub sends as ETag / oid for regular (non-LFS) files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


class HubError(Exception):
    """An error answer: HTTP status, the Hub's X-Error-Code (what huggingface_hub maps to exceptions), message."""

    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


class HubServer:
    """The in-memory hub on an ephemeral loopback port; a context manager (start on enter, stop on exit)."""

    def __init__(self, token: str = "hf_test", username: str = "me", max_request_bytes: int = 64 << 20,
                 max_total_bytes: int = 256 << 20, idle_timeout_s: float = 5.0):
        self.token, self.username = token, username
        self.max_request_bytes, self.max_total_bytes = max_request_bytes, max_total_bytes
        self.idle_timeout_s = idle_timeout_s
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.unhandled: list[tuple[str, str]] = []  # requests that no route matched
        self.errors: list[str] = []  # exceptions raised while answering (bugs in this server)
        self._lock = threading.Lock()
        self._stored_bytes = 0
        self._commit_counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        if self._httpd is None:
            raise RuntimeError("HubServer is not running; use it as `with HubServer() as hub:`")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        hub = self

        class Handler(_HubHandler):
            server_hub = hub
            timeout = hub.idle_timeout_s  # closes idle keep-alive connections, so shutdown never hangs

        self._httpd = _LoopbackServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()  # stops serve_forever
        self._httpd.server_close()  # closes the socket and joins the handler threads (bounded by their timeout)
        self._thread.join(timeout=self.idle_timeout_s + 5)
        self._httpd = self._thread = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ what tests inspect

    def head(self, repo_id: str, revision: str = DEFAULT_BRANCH) -> Commit:
        with self._lock:
            commit = self._repo(repo_id).resolve(revision)
        if commit is None:
            raise KeyError(f"{repo_id} has no revision {revision!r}")
        return commit

    def file(self, repo_id: str, path: str, revision: str = DEFAULT_BRANCH) -> bytes:
        return self.head(repo_id, revision).files[path]

    def history(self, repo_id: str, revision: str = DEFAULT_BRANCH) -> list[Commit]:
        """Commits reachable from ``revision``, newest first."""
        commits, commit = [], self.head(repo_id, revision)
        while commit is not None:
            commits.append(commit)
            commit = self.repos[repo_id].commits.get(commit.parent) if commit.parent else None
        return commits

    # ------------------------------------------------------------------ state changes (under the lock)

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", code="RepoNotFound")
        return repo

    def _new_commit(self, repo: Repo, parent: Commit | None, title: str, files: dict[str, bytes]) -> Commit:
        added = sum(len(data) for path, data in files.items() if parent is None or parent.files.get(path) is not data)
        if self._stored_bytes + added > self.max_total_bytes:
            raise HubError(413, f"storage limit of {self.max_total_bytes} bytes reached")
        self._stored_bytes += added
        self._commit_counter += 1
        digest = hashlib.sha1(f"{self._commit_counter}\0{parent.oid if parent else ''}\0{title}".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{git_blob_sha(files[path])}\0".encode())
        commit = Commit(digest.hexdigest(), parent.oid if parent else None, title, files)
        repo.commits[commit.oid] = commit
        return commit

    def create_repo(self, payload: dict) -> tuple[int, dict]:
        if payload.get("type", "model") not in (None, "model"):
            raise HubError(400, f"this test hub only hosts model repos, not {payload.get('type')!r}")
        name = payload.get("name")
        if not name or "/" in name:
            raise HubError(400, f"invalid repo name {name!r}")
        repo_id = f"{payload.get('organization') or self.username}/{name}"
        with self._lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
            repo = Repo(repo_id, private=payload.get("visibility") == "private")
            gitattributes = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
            initial = self._new_commit(repo, None, "initial commit", {".gitattributes": gitattributes})
            repo.branches[DEFAULT_BRANCH] = initial.oid
            self.repos[repo_id] = repo
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def create_branch(self, repo_id: str, branch: str, starting_point: str | None) -> tuple[int, dict]:
        with self._lock:
            repo = self._repo(repo_id)
            if branch in repo.branches:
                return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
            start = repo.resolve(starting_point or DEFAULT_BRANCH)
            if start is None:
                raise HubError(404, f"Invalid rev id: {starting_point}", code="RevisionNotFound")
            repo.branches[branch] = start.oid
        return 200, {}

    def commit(self, repo_id: str, revision: str, body: bytes) -> dict:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        with self._lock:
            repo = self._repo(repo_id)
            if revision not in repo.branches:
                raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
            parent = repo.commits[repo.branches[revision]]
            if header.get("parentCommit") not in (None, parent.oid):
                raise HubError(412, f"parent commit {header['parentCommit']} is not the head of {revision}")
            files = dict(parent.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, f"unsupported encoding {value.get('encoding')!r} for {value.get('path')}")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if files.pop(value["path"], None) is None:
                        raise HubError(404, "A file with this name doesn't exist", code="EntryNotFound")
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {path: data for path, data in files.items() if not path.startswith(prefix)}
                else:  # lfsFile cannot happen: preupload answers "regular" for every file
                    raise HubError(400, f"this test hub accepts only regular files, got a {key!r} operation")
            commit = self._new_commit(repo, parent, header.get("summary", ""), files)
            repo.branches[revision] = commit.oid
        url = f"{self.endpoint}/{repo_id}/commit/{commit.oid}"
        return {"commitUrl": url, "commitOid": commit.oid, "pullRequestUrl": None}


class _LoopbackServer(ThreadingHTTPServer):
    daemon_threads = False  # so server_close() waits for in-flight requests instead of abandoning them


class _HubHandler(BaseHTTPRequestHandler):
    """Routes one request to the in-memory hub; errors carry the Hub's X-Error-Code / X-Error-Message headers."""

    server_hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def do_GET(self):
        self._dispatch(send_body=True)

    def do_HEAD(self):
        self._dispatch(send_body=False)

    def do_POST(self):
        self._dispatch(send_body=True)

    # ------------------------------------------------------------------ plumbing

    def _dispatch(self, send_body: bool) -> None:
        hub = self.server_hub
        url = urlsplit(self.path)
        parts = [unquote(part) for part in url.path.strip("/").split("/")]
        self.query = parse_qs(url.query)
        hub.requests.append((self.command, url.path))
        try:
            body = self._read_body()
            route = self._route(parts)
            if route is None:
                hub.unhandled.append((self.command, url.path))
                raise HubError(404, f"{self.command} {url.path} is not implemented by the test hub")
            route(parts, body, send_body)
        except HubError as error:
            self._send_error(error, send_body)
        except Exception as error:  # a bug in this server: answer 500 (the client reports it) and record it
            hub.errors.append(f"{self.command} {url.path}: {error!r}")
            self._send_error(HubError(500, f"test hub failed: {error!r}"), send_body)

    def _route(self, parts: list[str]):
        method = self.command
        if method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo
        if method == "POST" and parts == ["api", "validate-yaml"]:
            return self._validate_yaml
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            action = parts[4] if len(parts) > 4 else None
            if method == "POST" and action == "preupload" and len(parts) == 6:
                return self._preupload
            if method == "POST" and action == "commit" and len(parts) == 6:
                return self._commit
            if method == "POST" and action == "branch" and len(parts) == 6:
                return self._create_branch
            if method == "GET" and (action is None or (action == "revision" and len(parts) == 6)):
                return self._model_info
            if method == "GET" and action == "tree" and len(parts) >= 6:
                return self._tree
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve
        return None

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > self.server_hub.max_request_bytes:
            self.close_connection = True  # the unread body would corrupt the next request
            raise HubError(413, f"request body of {length} bytes exceeds {self.server_hub.max_request_bytes}")
        return self.rfile.read(length) if length else b""

    def _require_token(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {self.server_hub.token}":
            raise HubError(401, "Invalid credentials in Authorization header")

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _send_json(self, status: int, payload, send_body: bool = True) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"}, send_body)

    def _send_error(self, error: HubError, send_body: bool) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        if error.commit:
            headers["X-Repo-Commit"] = error.commit
        self._send(error.status, json.dumps({"error": error.message}).encode(), headers, send_body)

    def _json_body(self, body: bytes) -> dict:
        try:
            return json.loads(body or b"{}")
        except json.JSONDecodeError as error:
            raise HubError(400, f"request body is not JSON: {error}") from None

    def _commit_for(self, repo_id: str, revision: str) -> Commit:
        with self.server_hub._lock:
            commit = self.server_hub._repo(repo_id).resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return commit

    # ------------------------------------------------------------------ routes

    def _create_repo(self, parts, body, send_body):
        self._require_token()
        status, payload = self.server_hub.create_repo(self._json_body(body))
        self._send_json(status, payload)

    def _validate_yaml(self, parts, body, send_body):
        content = self._json_body(body).get("content", "")
        if content.startswith("---\n"):
            front, sep, _ = content[4:].partition("\n---")
            try:
                metadata = yaml.safe_load(front) if sep else None
            except yaml.YAMLError as error:
                metadata = error
            if not isinstance(metadata, dict):
                reason = "is not closed by ---" if not sep else f"is not a YAML mapping ({metadata})"
                self._send_json(400, {"errors": [{"message": f"README.md metadata {reason}"}], "warnings": []})
                return
        self._send_json(200, {"errors": [], "warnings": []})

    def _preupload(self, parts, body, send_body):
        self._require_token()
        repo_id, revision = "/".join(parts[2:4]), parts[5]
        head = self._commit_for(repo_id, revision)
        files = self._json_body(body).get("files", [])
        answer = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": git_blob_sha(head.files[f["path"]]) if f["path"] in head.files else None}
            for f in files
        ]
        self._send_json(200, {"files": answer, "commitOid": head.oid})

    def _commit(self, parts, body, send_body):
        self._require_token()
        if self.query.get("create_pr"):
            raise HubError(400, "this test hub does not implement pull requests")
        self._send_json(200, self.server_hub.commit("/".join(parts[2:4]), parts[5], body))

    def _create_branch(self, parts, body, send_body):
        self._require_token()
        starting_point = self._json_body(body).get("startingPoint")
        self._send_json(*self.server_hub.create_branch("/".join(parts[2:4]), parts[5], starting_point))

    def _model_info(self, parts, body, send_body):
        repo_id = "/".join(parts[2:4])
        commit = self._commit_for(repo_id, parts[5] if len(parts) == 6 else DEFAULT_BRANCH)
        self._send_json(200, {
            "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit.oid,
            "private": self.server_hub.repos[repo_id].private, "disabled": False, "gated": False,
            "tags": [], "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def _tree(self, parts, body, send_body):
        repo_id, prefix = "/".join(parts[2:4]), "/".join(parts[6:])
        commit = self._commit_for(repo_id, parts[5])
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, folders = [], set()
        base = prefix + "/" if prefix else ""
        for path in sorted(commit.files):
            if not path.startswith(base):
                continue
            rest = path[len(base):]
            if "/" in rest and not recursive:
                folders.add(base + rest.split("/")[0])
                continue
            data = commit.files[path]
            entries.append({"type": "file", "path": path, "size": len(data), "oid": git_blob_sha(data)})
        entries += [{"type": "directory", "path": folder, "oid": ""} for folder in sorted(folders)]
        if prefix and not entries:
            message = f"{prefix} does not exist in {repo_id}@{parts[5]}"
            raise HubError(404, message, code="EntryNotFound", commit=commit.oid)
        self._send_json(200, entries)

    def _resolve(self, parts, body, send_body):
        repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        commit = self._commit_for(repo_id, revision)
        data = commit.files.get(path)
        if data is None:
            message = f"{path} does not exist in {repo_id}@{revision}"
            raise HubError(404, message, code="EntryNotFound", commit=commit.oid)
        # huggingface_hub needs X-Repo-Commit and an ETag (the git blob id for a regular file) on every file.
        headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_sha(data)}"'}
        self._send(200, data, headers, send_body)
