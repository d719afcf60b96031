"""FTW validation errors: one class per numbered rule of specs/ftw.md (V1..V22).

Every message names the file and what is wrong, so a user can act on one line of output.
"""

from __future__ import annotations


class FtwError(ValueError):
    """Base class: anything wrong with an FTW directory. `rule` is the spec's rule id (e.g. "V3")."""

    rule = "V?"
    title = "invalid FTW"

    def __init__(self, where: object, detail: str) -> None:
        self.where = str(where)
        self.detail = detail
        super().__init__(f"{self.where}: {self.rule} {self.title}: {detail}")


def _rule(name: str, rule: str, title: str, doc: str) -> type[FtwError]:
    return type(name, (FtwError,), {"rule": rule, "title": title, "__doc__": doc, "__module__": __name__})


FtwNotFoundError = _rule("FtwNotFoundError", "V1", "missing file",
                         "The directory, model.ftw, a data file or an asset is missing.")
FtwTruncatedError = _rule("FtwTruncatedError", "V2", "truncated index",
                          "model.ftw is shorter than its header, or not 64 + manifest_nbytes bytes.")
FtwMagicError = _rule("FtwMagicError", "V3", "bad magic",
                      "The first 8 bytes are not the FTW magic.")
FtwVersionError = _rule("FtwVersionError", "V4", "unsupported version",
                        "The major version is not one this reader knows.")
FtwHeaderError = _rule("FtwHeaderError", "V5", "bad header",
                       "Header size, manifest offset or reserved bytes are wrong.")
FtwManifestTooLargeError = _rule("FtwManifestTooLargeError", "V6", "manifest too large",
                                 "The manifest exceeds the size limit.")
FtwManifestChecksumError = _rule("FtwManifestChecksumError", "V7", "manifest checksum",
                                 "The manifest bytes do not hash to the header value.")
FtwManifestParseError = _rule("FtwManifestParseError", "V8", "manifest parse",
                              "The manifest is not a UTF-8 JSON object (or has duplicate keys).")
FtwSchemaError = _rule("FtwSchemaError", "V9", "manifest schema",
                       "A required key is missing, unknown, or of the wrong type/value.")
FtwFeatureError = _rule("FtwFeatureError", "V10", "unknown required feature",
                        "`requires` names a feature this reader lacks.")
FtwPathError = _rule("FtwPathError", "V11", "unsafe path",
                     "A file name is not a plain name inside the directory, or not the one the rules fix.")
FtwDtypeError = _rule("FtwDtypeError", "V12", "unknown dtype or scheme",
                      "A dtype or quantization scheme id is not in the tables.")
FtwShapeError = _rule("FtwShapeError", "V13", "shape mismatch",
                      "nbytes disagrees with dtype and shape, or geometry is invalid.")
FtwAlignmentError = _rule("FtwAlignmentError", "V14", "misaligned",
                          "An offset or stride breaks the alignment rule.")
FtwRangeError = _rule("FtwRangeError", "V15", "out of range",
                      "A region lies outside its file, record or file list.")
FtwOverlapError = _rule("FtwOverlapError", "V16", "overlap",
                        "Two regions of one data file overlap.")
FtwDuplicateError = _rule("FtwDuplicateError", "V17", "duplicate name",
                          "Two tensors, banks or assets share a name.")
FtwFileSizeError = _rule("FtwFileSizeError", "V18", "file size",
                         "A data file or asset on disk differs from its declared size.")
FtwConfigError = _rule("FtwConfigError", "V19", "model config",
                       "The normalized model config is invalid or names an unknown family.")
FtwChecksumError = _rule("FtwChecksumError", "V20", "checksum mismatch",
                         "Content bytes do not hash to the recorded xxh3-64 value.")
FtwPaddingError = _rule("FtwPaddingError", "V21", "non-zero padding",
                        "Bytes between regions are not zero.")
FtwKernelsError = _rule("FtwKernelsError", "V22", "kernels entry",
                        "A kernels/ entry is not a valid kernels container (§5.7).")
FtwPlanError = _rule("FtwPlanError", "V23", "bad plan",
                     "A plans/<name>.json entry is not a valid placement plan for this model (specs/plan.md).")

ALL_ERRORS: tuple[type[FtwError], ...] = (
    FtwNotFoundError, FtwTruncatedError, FtwMagicError, FtwVersionError, FtwHeaderError,
    FtwManifestTooLargeError, FtwManifestChecksumError, FtwManifestParseError, FtwSchemaError,
    FtwFeatureError, FtwPathError, FtwDtypeError, FtwShapeError, FtwAlignmentError, FtwRangeError,
    FtwOverlapError, FtwDuplicateError, FtwFileSizeError, FtwConfigError, FtwChecksumError,
    FtwPaddingError, FtwKernelsError, FtwPlanError,
)
