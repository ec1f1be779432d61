/* Decode one rectangle of a JPEG, at a power-of-two DCT scale, with libjpeg-turbo.
 *
 * A random-resized crop needs only the rows and columns of its box. Entropy (Huffman) decoding is
 * most of the cost of a baseline JPEG and is sequential, so the rows below the box are the saving that
 * matters: decoding stops at the box's last row. Rows above it are entropy-decoded but not
 * transformed (jpeg_skip_scanlines) and columns outside it are not transformed either
 * (jpeg_crop_scanline). Neither simplejpeg nor Pillow exposes these calls, hence this module.
 *
 *   decode_region(data, denominator, left, top, right, bottom) -> bytes
 *
 * Coordinates are in the scaled image (full size / denominator, rounded up). The result is RGB, rows
 * ``top`` to ``bottom`` of the scaled image at its full width; columns ``left`` to ``right`` are
 * decoded (a few more: libjpeg-turbo starts at an iMCU boundary) and the rest are zero. Full-width
 * rows let the caller resize with exactly the geometry of a whole-image decode: Pillow's resampling
 * of a box is not quite independent of the image around it. Bytes libjpeg cannot decode, or decodes
 * only with a warning (corrupt or truncated data), and colour spaces it cannot turn into RGB (CMYK)
 * raise ValueError; the caller then lets Pillow decide.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

/* Before 2.1.3, jpeg_crop_scanline with fast upsampling could write past the end of a cropped row
   (libjpeg-turbo ChangeLog 2.1.3); the build fails here, and setup.py then installs without this module. */
#if !defined(LIBJPEG_TURBO_VERSION_NUMBER) || LIBJPEG_TURBO_VERSION_NUMBER < 2001003
#error "the JPEG region decoder needs libjpeg-turbo 2.1.3 or newer"
#endif

#define ROWS_PER_CALL 16

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf escape;
  char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void on_error(j_common_ptr cinfo) {
  ErrorManager *err = (ErrorManager *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->escape, 1);
}

/* A warning (e.g. "Corrupt JPEG data", "Premature end of JPEG file") means the pixels are not what the
 * file meant: treated as an error, like simplejpeg's strict mode. Trace messages (level > 0) are ignored. */
static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) on_error(cinfo);
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer data;
  int denominator, left, top, right, bottom;
  if (!PyArg_ParseTuple(args, "y*iiiii", &data, &denominator, &left, &top, &right, &bottom)) return NULL;
  if (denominator != 1 && denominator != 2 && denominator != 4 && denominator != 8) {
    PyBuffer_Release(&data);
    return PyErr_Format(PyExc_ValueError, "denominator must be 1, 2, 4 or 8, not %d", denominator);
  }

  struct jpeg_decompress_struct cinfo;
  ErrorManager err;
  /* volatile: read after a longjmp. */
  volatile int created = 0;
  PyObject *volatile pixels = NULL;
  PyThreadState *volatile released = NULL;

  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  err.message[0] = '\0';
  if (setjmp(err.escape)) {
    if (created) jpeg_destroy_decompress(&cinfo);
    if (released) PyEval_RestoreThread(released);
    Py_XDECREF((PyObject *)pixels);
    PyBuffer_Release(&data);
    PyErr_Format(PyExc_ValueError, "libjpeg: %s", err.message);
    return NULL;
  }
  /* The header, with the GIL held (it is quick), to size and check the region before any decoding
     (for a progressive JPEG, jpeg_start_decompress decodes the whole file). */
  jpeg_create_decompress(&cinfo);
  created = 1;
  jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
  jpeg_read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)denominator;
  cinfo.dct_method = JDCT_IFAST;       /* as simplejpeg's fastdct */
  cinfo.do_fancy_upsampling = FALSE;   /* as simplejpeg's fastupsample */
  jpeg_calc_output_dimensions(&cinfo);
  if (left < 0 || top < 0 || right <= left || bottom <= top || (JDIMENSION)right > cinfo.output_width ||
      (JDIMENSION)bottom > cinfo.output_height) {
    snprintf(err.message, sizeof err.message, "region (%d, %d, %d, %d) is not inside the %u x %u scaled image",
             left, top, right, bottom, cinfo.output_width, cinfo.output_height);
    longjmp(err.escape, 1);
  }
  /* Rows as wide as the whole scaled image (zeros outside the decoded columns), so that the caller
     can resample with the same geometry as after a full decode. */
  const size_t row_bytes = (size_t)cinfo.output_width * 3;
  pixels = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(row_bytes * (size_t)(bottom - top)));
  if (pixels == NULL) {
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return NULL;   /* MemoryError is set */
  }
  unsigned char *out = (unsigned char *)PyBytes_AS_STRING((PyObject *)pixels);
  memset(out, 0, row_bytes * (size_t)(bottom - top));

  /* The decoding itself touches no Python state (pixels is not shared yet): grain's threads decode
     in parallel. */
  released = PyEval_SaveThread();
  jpeg_start_decompress(&cinfo);
  JDIMENSION x = (JDIMENSION)left, width = (JDIMENSION)(right - left);
  if (width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &x, &width);   /* x moves to an iMCU edge */
  if (top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)top);
  while (cinfo.output_scanline < (JDIMENSION)bottom) {
    /* Several rows per call: libjpeg produces a whole iMCU row (8-16 rows) at a time anyway. */
    JSAMPROW rows[ROWS_PER_CALL];
    JDIMENSION n = 0;
    for (; n < ROWS_PER_CALL && cinfo.output_scanline + n < (JDIMENSION)bottom; n++)
      rows[n] = out + (size_t)(cinfo.output_scanline + n - (JDIMENSION)top) * row_bytes + (size_t)x * 3;
    jpeg_read_scanlines(&cinfo, rows, n);
  }
  /* Stop here: the rows below the box are never entropy-decoded. */
  jpeg_destroy_decompress(&cinfo);
  PyEval_RestoreThread(released);
  PyBuffer_Release(&data);
  return (PyObject *)pixels;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, denominator, left, top, right, bottom) -> RGB bytes of rows top..bottom"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_region", "Decode one rectangle of a JPEG (libjpeg-turbo).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpeg_region(void) { return PyModule_Create(&module); }
